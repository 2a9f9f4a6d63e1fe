"""A vLLM engine's model — continuous batching under a KV capacity, its prefix cache, its step times by
hardware profile — and the emulated vLLM server that runs it in real time. The simulator runs the same model on
its virtual clock (``fairgate.sim``); ``fairgate serve`` starts emulated servers when no backend is named, and
reads the profiles for its latency fits' priors, without importing the simulator."""
