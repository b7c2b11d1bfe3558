"""The command line (click): `appliance train | eval | export | plan | doctor | bench`, in main.py.

Each command parses its flags into the typed config (appliance/config/) and hands over to the
package that does the work: run/ (train), adapter/ (eval, export), plan/ (plan, doctor), bench/.
Nothing is imported here: `appliance` (appliance/__main__.py) imports main.py, and torch with
it, only once its Ctrl-C handling is in place."""

__all__: list[str] = []  # the command line is cli/main.py: appliance.cli.main.main
