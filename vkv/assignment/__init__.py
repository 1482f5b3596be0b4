"""Instructor tooling: solution regions, the student edition, the soundness check, grading."""
