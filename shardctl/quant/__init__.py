"""Quantized checkpoints: read ``quantization_config``, group stored tensors under the weight
they encode (:mod:`shardctl.quant.groups`), dequantize for verify (:mod:`shardctl.quant.dequant`).

No torch at import: ``plan`` and the layout engine use :mod:`config` and :mod:`groups` only.
"""
