"""The reproducibility matrix of DESIGN.md §5 (`matrix`) and its report (`report`)."""

