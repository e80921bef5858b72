"""The gateway's Envoy front end: an Endpoint Picker (EPP) of the Gateway API Inference Extension
(design.md §6). It exposes Envoy's ext_proc gRPC protocol (ExternalProcessor) and its health on
`--epp-port`: Envoy asks which worker a request goes to and gets the choice of the routing core
(gateway/core/: the same tenants, router, policy and index); Envoy then proxies the request. protocol.py: the wire (headers, bodies, the answers the EPP protocol defines);
servicer.py: one ext_proc stream per HTTP request; server.py: its port, health and drain."""
