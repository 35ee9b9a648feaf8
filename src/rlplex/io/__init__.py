"""Low-level input and output every layer uses: reading files that others can write
(`safe_files`), iteration snapshots in safetensors and JSON (`snapshot`, which imports torch:
import it only where torch is loaded anyway), and shared memory's lifetime (`shm_reaper`) and
cross-process waiting on it (`shm_sync`). Of rlplex, imports only `rlplex.errors`."""
