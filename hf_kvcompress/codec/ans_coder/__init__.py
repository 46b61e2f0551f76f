"""The ``ans`` coder: adaptive windows coded with constriction's ANS coder (`ans.AnsCoder`)."""
