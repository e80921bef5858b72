"""Measurements of the whole stack: `http` (the HTTP front against gRPC, time to first token),
`auth` (a cache Step round trip with service authentication off and on) and `fault_drill`
(faults injected under load: failed and wrong requests)."""
