"""ONNX models in: `precision_tool.onnx.load(path) -> ImportedModel` (needs the onnx package,
`pip install 'precision_tool[onnx]'`). See importer.py for what the import does, rules.py for
the ops it covers, and reference.py for ONNX Runtime as a second reference."""
from .importer import (ImportedModel, OnnxImportError, UnsupportedModelError, load,  # noqa: F401
                       read_model)


def supported_ops():
    """The ONNX op types the importer translates."""
    from .converters import RULES
    return sorted(RULES)
