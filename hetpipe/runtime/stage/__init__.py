"""Stage building: split a traced program into per-stage modules and materialise one on its device."""
