from meridian.cli.main import app

app(prog_name="meridian")
