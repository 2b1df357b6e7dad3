"""`IPython.display` names SGLang imports; calling them means a notebook path was taken in a server."""

from stub_missing import Missing

HTML = Missing("IPython.display.HTML")
display = Missing("IPython.display.display")
