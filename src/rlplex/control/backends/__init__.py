"""Where nodes run: the `Scheduler` protocol and its two implementations, local OS processes
(`LocalScheduler`) and detached Ray actors (`RayScheduler`, with the master as a Ray actor), both
reporting to the master's heartbeat server (`served`)."""
