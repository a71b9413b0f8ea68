"""The ``custom-cuda`` backend: the step runner (``runner``), its options (``options``) and the Triton ops it installs
(``norm_ops``, ``attention_ops``, ``projection_ops``, ``moe_ops``)."""
