"""Independent reference implementations (PyTorch) used as parity oracles."""

