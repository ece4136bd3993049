"""Placement search (MARS): where each contiguous run of a model's nodes runs, on which workers, checked in a simulator."""
