"""The numerics: datatypes and their levels, affine scales, outlier thresholds, the vector quantizers, TurboQuant's
rotation, bit packing and RoPE. Pure torch and numpy; nothing here knows a method name, a recipe or a model."""
