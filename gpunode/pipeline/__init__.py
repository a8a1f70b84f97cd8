"""The boot pipeline: the one list of steps that plan and boot walk, the boot record, and the
shortcuts that answer a CPU node's or an unchanged node's boot before the pipeline loads."""
