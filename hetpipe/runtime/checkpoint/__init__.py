"""Training checkpoints that move between plans: `files` (layout, completion marker, checks),
`state` (one rank's save and restore with torch.distributed.checkpoint), `options` (``hetpipe run``'s
checkpoint options, checked before launch)."""
