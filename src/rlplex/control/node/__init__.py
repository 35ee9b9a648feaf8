"""A node from the inside and from the master: the node process's runtime, the `Worker` hooks it
runs, the master's `NodeSlot` view of it, and `RoleGroup` calls into a role's nodes."""
