"""Another module of the user's: constants its code reads as ``identity_cfg.SCALE`` (through the module object)."""

SCALE = 1.0
