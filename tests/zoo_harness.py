"""The model-zoo acceptance run, shared by tests/test_model_zoo.py and benchmarks/model_zoo.py.

For one `Family`: build the model on the CPU with its own initialisation (seeded), write
those weights where ``--weights`` reads them (``save_pretrained`` for Hugging Face models,
a torch state dict otherwise), write 3 global batches for ``--data``, then through the CLI
``hetpipe plan --loss --data`` on the mini home lab in one box (examples/clusters/zoo-mini.yaml: 3 uneven
stages) and ``hetpipe run --emulate --weights --data --loss --save-weights``; finally train the same CPU model with a plain PyTorch
loop (gradient accumulation over the same micro-batches in the same order, Adam at the
runtime's default learning rate) and compare per-step losses and the saved final
parameters and buffers with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from hetpipe.plan.schema import Plan
from hetpipe.runtime.report import RunReport
from tests.machine_load import guard_s

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "zoo-mini.yaml"
STEPS, MICROBATCHES, MICRO_BATCH, SEQ = 3, 4, 2, 16
SEED = 0
ADAM_LR = 1e-3  # hetpipe.runtime.worker.DEFAULT_LR["adam"]: the plan's optimizer at its default rate


@dataclass(frozen=True)
class Family:
    """One zoo entry: how to name it on the command line and which loss trains it."""

    label: str
    model: str
    loss: str
    sized: bool  # takes --batch/--seq (built-in and Hugging Face models), else a factory
    seq: int | None = SEQ

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf")


_HF_LM = "hetpipe.models.hf:lm_loss"
FAMILIES: tuple[Family, ...] = (
    Family("HF Llama (LlamaForCausalLM)", "hf-llama-tiny", _HF_LM, True),
    Family("HF Qwen2 (Qwen2ForCausalLM, tied head)", "hf-qwen2-tiny", _HF_LM, True),
    Family("HF BERT masked LM (BertForMaskedLM)", "hf-bert-mlm-tiny", _HF_LM, True),
    Family("HF BERT base model (BertModel)", "hf-bert-tiny", "hetpipe.models.hf:hidden_loss", True),
    Family("HF GPT-2 (GPT2LMHeadModel)", "hf-gpt2-tiny", _HF_LM, True),
    Family("HF T5 (T5ForConditionalGeneration via Seq2SeqTraining)", "hf-t5-tiny", _HF_LM, True),
    Family("BatchNorm CNN (factory)", "tests.zoo_models:bn_cnn", "hetpipe.models:classification_loss", False, None),
    Family("resnet-tiny (built-in, BatchNorm)", "resnet-tiny", "hetpipe.models:classification_loss", True, None),
    Family("tied-embedding LM (factory)", "tests.zoo_models:tied_lm", "tests.zoo_models:logits_loss", False, None),
    Family("dense MoE LM, dict output (factory)", "tests.zoo_models:moe_lm", "tests.zoo_models:logits_loss", False,
           None),
)


def by_model(name: str) -> Family:
    return next(f for f in FAMILIES if f.model == name)


def _load(spec: str) -> Callable[..., Any]:
    from hetpipe.plan.user_code import import_callable  # the CLI's own import rules

    return import_callable(spec, option="--loss")


def reference_model(family: Family) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model on the CPU with its own seeded initialisation, and one example micro-batch."""
    from hetpipe import models

    torch.manual_seed(SEED)
    r = models.resolve(family.model, device="cpu", batch=MICRO_BATCH if family.sized else None,
                       seq=family.seq if family.sized else None)
    return r.model, r.example_inputs


def write_weights(family: Family, model: nn.Module, out: Path) -> Path:
    """HF models: ``save_pretrained`` (safetensors, tied copies left out); others: a torch state dict file."""
    if family.is_hf:
        model.save_pretrained(out / "weights")
        return out / "weights"
    torch.save(model.state_dict(), out / "weights.pt")
    return out / "weights.pt"


def make_batches(family: Family, example: tuple[torch.Tensor, ...]) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
    """`STEPS` seeded global batches of `MICROBATCHES` x the example micro-batch, with their targets."""
    from hetpipe import models

    gen = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for _ in range(STEPS):
        inputs = []
        for t in example:
            shape = (MICRO_BATCH * MICROBATCHES, *t.shape[1:])
            if t.dtype.is_floating_point:
                inputs.append(torch.randn(shape, generator=gen))
            else:
                vocab = models.input_vocab(family.model) or 64  # tests.zoo_models.VOCAB
                inputs.append(torch.randint(0, vocab, shape, generator=gen))
        x = inputs[0]
        if family.sized:
            targets = models.example_targets(family.model, tuple(inputs))
        elif x.dtype.is_floating_point:  # the BatchNorm CNN: class indices
            targets = torch.randint(0, 5, (x.shape[0],), generator=gen)
        else:
            targets = torch.roll(x, -1, 1)
        if targets.dtype.is_floating_point:  # regenerate from our generator: reproducible across processes
            targets = torch.randn(targets.shape, generator=gen)
        batches.append((tuple(inputs), targets))
    return batches


def reference_losses(family: Family, model: nn.Module, batches: list[Any]) -> list[float]:
    """Plain single-device training: per step, the mean loss over micro-batches, gradients accumulated."""
    from hetpipe.partitioner.capture.export import training_config

    loss_fn = _load(family.loss)
    opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    model.train()
    losses = []
    with training_config(model):
        for inputs, targets in batches:
            opt.zero_grad()
            total = 0.0
            chunks = [t.chunk(MICROBATCHES) for t in inputs]
            for k, y in enumerate(targets.chunk(MICROBATCHES)):
                loss = loss_fn(model(*(c[k] for c in chunks)), y)
                (loss / MICROBATCHES).backward()
                total += float(loss.detach())
            opt.step()
            losses.append(total / MICROBATCHES)
    return losses


def saved_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor `--save-weights` wrote (the shards of its index)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def state_difference(model: nn.Module, saved: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """(max |saved - reference| over every saved tensor, reference parameters not saved under any name)."""
    ref = dict(model.named_parameters(remove_duplicate=False))
    ref.update(model.named_buffers(remove_duplicate=False))
    unknown = sorted(set(saved) - set(ref))
    assert not unknown, f"saved tensors the model does not have: {unknown}"
    worst = max(float((saved[k].float() - ref[k].detach().float()).abs().max()) for k in saved)
    covered = {id(ref[k]) for k in saved}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    return worst, missing


@dataclass(frozen=True)
class ZooResult:
    family: Family
    capture_s: float
    plan: Plan
    report: RunReport | None
    returncode: int
    ref_losses: tuple[float, ...]
    max_state_diff: float
    missing: tuple[str, ...]
    buffers_saved: int

    @property
    def losses(self) -> tuple[float, ...]:
        return tuple(self.report.losses) if self.report else ()

    @property
    def memory_ratios(self) -> tuple[float, ...]:
        """Per stage: measured peak held bytes (the run report's ledger) / the plan's M_s."""
        return tuple(s.peak_bytes / s.predicted_memory_bytes for s in self.report.stages) if self.report else ()

    @property
    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses, self.ref_losses)) if self.losses else float("nan")


def cli(argv: list[str]) -> int:
    from hetpipe.cli import app

    return app.main(argv)


def plan_family(family: Family, out: Path, data: Path | None = None, *,
                time_capture: bool = False) -> tuple[Path, float]:
    """``hetpipe plan`` on `CLUSTER`, with the run's ``--loss`` and ``--data`` when ``data`` is given (so the
    plan costs what that loss saves on the last stage, as the run's memory ledger counts it); returns
    (plan path, capture seconds measured apart when ``time_capture``, else NaN: the tests do not read it
    and one more capture of an HF model costs ~1 s of CPU)."""
    capture_s = _capture_seconds(family) if time_capture else float("nan")
    path = out / "plan.json"
    sizes = ["--batch", str(MICRO_BATCH)] + (["--seq", str(family.seq)] if family.seq else []) if family.sized else []
    rc = cli(["plan", family.model, "--cluster", str(CLUSTER), *sizes, "--global-batch",
              str(MICRO_BATCH * MICROBATCHES), *(["--loss", family.loss, "--data", str(data)] if data else []),
              "-o", str(path)])
    assert rc == 0, f"hetpipe plan {family.model} exited {rc}"
    return path, capture_s


def _capture_seconds(family: Family) -> float:
    """Wall seconds of one capture of the family on meta (for benchmarks/model_zoo.py's table)."""
    from hetpipe import models
    from hetpipe.partitioner.capture.capture import capture

    r = models.resolve(family.model, device="meta", batch=MICRO_BATCH if family.sized else None,
                       seq=family.seq if family.sized else None)
    start = time.perf_counter()
    capture(r.model, r.example_inputs, name=family.model)
    return time.perf_counter() - start


def zoo_case(family: Family, out: Path, *, time_capture: bool = False) -> ZooResult:
    """The whole acceptance run of one family in ``out`` (see the module docstring); ``capture_s`` is
    measured only with ``time_capture``."""
    out.mkdir(parents=True, exist_ok=True)
    model, example = reference_model(family)
    weights = write_weights(family, model, out)
    batches = make_batches(family, example)
    torch.save(batches, out / "data.pt")
    plan_path, capture_s = plan_family(family, out, out / "data.pt", time_capture=time_capture)
    saved_dir, report_path = out / "trained", out / "run.json"
    argv = ["run", str(plan_path), "--model", family.model, "--steps", str(STEPS), "--emulate",
            "--weights", str(weights), "--data", str(out / "data.pt"), "--loss", family.loss,
            "--save-weights", str(saved_dir), "--report", str(report_path), "--run-dir", str(out / "run"),
            "--timeout", f"{guard_s(60.0):.0f}"]
    if family.sized and family.seq:
        argv += ["--seq", str(family.seq)]
    rc = cli(argv)
    ref = reference_losses(family, model, batches)
    report = RunReport.load(report_path) if rc == 0 else None
    saved = saved_state(saved_dir) if rc == 0 else {}
    worst, missing = state_difference(model, saved) if saved else (float("nan"), [])
    buffer_names = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return ZooResult(family, capture_s, Plan.load(plan_path), report, rc, tuple(ref), worst, tuple(missing),
                     sum(1 for k in saved if k in buffer_names))
