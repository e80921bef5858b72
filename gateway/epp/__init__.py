"""The gateway as an Endpoint Picker (EPP) of the Gateway API Inference Extension (design.md §6):
Envoy's ext_proc gRPC protocol on `--epp-port`, picking workers with the gateway's own router,
policy and index. protocol.py: the wire (headers, bodies, the answers the EPP protocol defines);
servicer.py: one ext_proc stream per HTTP request; server.py: its port, health and drain."""
