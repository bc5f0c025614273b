"""`specdec distill`: a drafter trained toward its target from recorded traffic or prompts."""
