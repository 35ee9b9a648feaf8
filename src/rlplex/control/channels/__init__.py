"""`DataChannel` (seed 003): the bounded, ordered queue between the stages of a worker self-loop,
with one local implementation (a /dev/shm ring, `LocalDataChannel`) and one on Ray's object store
(`RayDataChannel`), and `run_self_loop`, the stage loop over them."""
