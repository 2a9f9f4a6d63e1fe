"""The control plane: the backend pool, tenants and weights, FairServe's and locality's live state,
settings applied live, metrics and the operations routes."""
