"""Shared-memory IPC (replay buffer, weight sync, control block) used by the training scripts."""
