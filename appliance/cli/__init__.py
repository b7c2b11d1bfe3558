"""The command line (click): `appliance train | eval | generate | export | plan | doctor | bench`.

main.py: the group and `train`; adapter_commands.py: eval, generate, export; machine_commands.py:
bench, plan, doctor; common.py: what they share (errors as one line, the --data hint, grouped help).

Each command parses its flags into the typed config (appliance/config/) and hands over to the
package that does the work: run/ (train), adapter/ (eval, export), plan/ (plan, doctor), bench/.
Nothing is imported here: `appliance` (appliance/__main__.py) imports main.py, and torch with
it, only once its Ctrl-C handling is in place."""

__all__: list[str] = []  # the command line is cli/main.py: appliance.cli.main.main
