"""kerasdist's built-in exporters, one plugin per family of formats it writes (``kerasdist.export``):

- :mod:`.litert`: "litert", "litert-dynamic", "litert-float16", "litert-int8" (plugin ``litert``);
- :mod:`.onnx`: "onnx", "onnx-int8" (plugin ``onnx``);
- :mod:`.tensorrt`: "tensorrt" engines, built from the "onnx" formats (plugin ``tensorrt``).

Each is an ordinary plugin of the public toolkit :mod:`kerasdist.exporting`: none imports another, so
``KERASDIST_DISABLE_PLUGINS`` holds for each, and a third-party exporter can reuse all they share.
"""
