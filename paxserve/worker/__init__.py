"""The device side: the model runner and its persistent batch, step inputs, the jitted step
functions, compiled programs and their buckets, memory planning, sampling."""
