"""redline.sync: trainer -> engine weight sync (bucket plan, pipelined CUDA-IPC protocol, NCCL broadcast) and
colocation memory (pausable VMM pool, the colocated step sequence). See sync/README.md for the contract."""
