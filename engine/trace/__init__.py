"""Looking back: reading finished samples, drawing the machine and the paths samples took.

Membership: code that reads recorded samples or draws the machine (`diagram`, `trace`, `flow`,
the run summary). Never imported inside a slime job.
"""
