"""The request pipeline: a request from the listener to its answer (identity, validation, the
forwarded body, the dispatcher's queue, the upstream call and the relay of its stream)."""
