"""The vLLM workers' idle-spin settings: written by the trainer side (`rljax.rollout.placement`, into a
server's environment), read inside vLLM by the plugin (`worker.plugin.quiet_idle_spin`). Here, not in either,
so that neither side imports the other (the worker side is vLLM's to load, by name)."""

IDLE_SPIN_ENV = "RLJAX_VLLM_IDLE_SPIN_S"
IDLE_RECHECK_MS = 5  # a sleeping queue reader's re-check period (bounds the cost of a lost wake-up ping)
