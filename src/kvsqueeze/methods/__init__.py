"""Methods: their names (`spec`: the grammar and `MethodSpec`), the registry of their families (`families`: how
each builds its quantizers, what it stores, which paths run it) and the bit budgets of `nuq@B` (`budget`: which
width and outliers each layer, or each channel, gets)."""

from .spec import (DEFAULT_CONTEXT, FAMILIES, FAMILY_DEFAULTS, FIT_VARIANTS, FIXED_AXES, PRESETS, SUPPORTED_BITS,
                   MethodError, MethodSpec, canonical_name, fixed_outlier_count, max_outliers_per_side, parse_method,
                   parse_methods, preset_for, preset_reaching, preset_window, topk_per_side)
from .families import (PATHS, REGISTRY, average_bits, build_quantizers, cache_bytes, check_path, describe,
                       family, is_unquantized, needs_recipe)

__all__ = ["DEFAULT_CONTEXT", "FAMILIES", "FAMILY_DEFAULTS", "FIT_VARIANTS", "FIXED_AXES", "PRESETS", "SUPPORTED_BITS",
           "MethodError", "MethodSpec", "canonical_name", "fixed_outlier_count", "max_outliers_per_side",
           "parse_method", "parse_methods", "preset_for", "preset_reaching", "preset_window", "topk_per_side", "PATHS",
           "REGISTRY", "average_bits", "build_quantizers", "cache_bytes", "check_path", "describe", "family",
           "is_unquantized", "needs_recipe"]
