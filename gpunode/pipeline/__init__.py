"""The boot pipeline: the one list of steps that plan and boot walk, the boot record, and the
shortcut that answers a CPU node's boot before the pipeline loads."""
