"""What a user says, in one vocabulary: the strategy names (`strategies.py`), the precision
names and what each means (`precisions.py`), the public calls' arguments checked before
anything happens (`arguments.py`) and the error a `phalanx` command raises
(`command_error.py`). It imports nothing of phalanx outside itself."""
