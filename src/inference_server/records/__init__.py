"""Records: the frozen values that cross actor channels and the engine's client boundary.

This is the bottom layer: modules here import nothing from the rest of ``inference_server`` except each
other, so every layer above (``core``, ``actors``, ``backends``, ``http``) can depend on them freely.
"""
