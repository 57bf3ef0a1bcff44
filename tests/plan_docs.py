"""Plan documents as older hetpipe wrote them, for the version tests."""

from __future__ import annotations

from typing import Any


def as_version_3(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a version-4 plan's dict) without the version-4 fields: no objective, no step tables, and
    T = the H-1F1B estimate it records; version 3 (what hetpipe wrote before issue 17), memory model 2
    (its 1F1B stages priced as memory model 3 prices them: `hetpipe.plan.check.same_memory_model`)."""
    doc = dict(as_memory_model_4(doc), version=3, memory_model=2)
    for key in ("objective", "step_launch_s"):
        doc.pop(key, None)
    for unit in doc["units"]:
        unit.pop("transient_bwd_bytes", None)  # memory model 4's table (version 8): priced 0, as model 2 did
        for times in unit["time_s"].values():
            times.pop("step", None)
    for st in doc["stages"]:
        st.pop("step_s", None)
    predicted = dict(doc["predicted"])
    estimate = predicted.pop("t_1f1b_estimate_s", predicted["iteration_s"])
    if not doc.get("replicas"):
        predicted["iteration_s"] = estimate
        doc["solver"] = dict(doc["solver"], objective_s=estimate)
    doc["predicted"] = predicted
    return doc


def as_memory_model_4(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a plan's dict) without memory model 5's step tables (version 9): a version-8 plan of memory model 4
    (its stages' memory_bytes as recorded: the caller sets them where the step's moment bound)."""
    doc = dict(doc, version=min(doc["version"], 8), memory_model=min(doc.get("memory_model", 4), 4))
    doc.pop("step_transient", None)
    doc["units"] = [{k: v for k, v in u.items() if k not in ("step_param_bytes", "step_tensor_bytes")}
                    for u in doc["units"]]
    model = dict(doc["model"])
    model["tied"] = [{k: v for k, v in t.items() if k != "step_bytes"} for t in model.get("tied", [])]
    doc["model"] = model
    return doc
