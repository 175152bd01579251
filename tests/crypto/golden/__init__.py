"""Stored outputs of the pre-issue-41 programs and the cases that produce them."""
