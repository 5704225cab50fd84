"""Model shape presets, one place that bench/, tests/ and training/ import; and transformers building
them (hf_reference.py: random-weight checkpoints, and the parity oracle reading one back).
The design in full: DESIGN.md section 5, "Model presets".
"""
