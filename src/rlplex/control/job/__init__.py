"""A job as the master sees it: the spec (roles), the state machines and the SQLite store that
keep its life, placement of roles into bundles, health decisions, and the `PrimeMaster` and its
`PrimeManager` control loop."""
