"""Low-level input and output every layer uses: reading files that others can write
(`safe_files`), and shared memory's lifetime (`shm_reaper`) and cross-process waiting on it
(`shm_sync`). Imports nothing else of rlplex."""
