"""`kvgen chat`: an interactive conversation in the terminal (session.py: the conversation; cli.py:
the command and its input loop)."""
