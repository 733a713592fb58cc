"""fedge's device side: wire protocol, device agent, trainer backends, update encoding.

Importing this package (and its ORT backend) never imports torch, so a device that has only
ONNX Runtime can run it.
"""
__version__ = "0.1.0"
