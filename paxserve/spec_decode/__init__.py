"""Speculative decoding: proposers on the host (pure Python + numpy) and the bookkeeping of what the
verification step accepted. The verification itself runs in the step's sampler
(`paxserve.worker.sampling.verify`)."""
