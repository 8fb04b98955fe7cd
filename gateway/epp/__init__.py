"""`hetgate epp`: hetgate as the Endpoint Picker (Envoy ext_proc) of an inference-extension gateway.

Needs the optional extra `hetgate[epp]` (grpcio, grpcio-health-checking, xds-protos); `serve` never imports
this package. See docs/epp.md.
"""
