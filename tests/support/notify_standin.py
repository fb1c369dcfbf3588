"""A stand-in desktop notification service: owns `org.freedesktop.Notifications` on the session
bus (the one in DBUS_SESSION_BUS_ADDRESS — a private one from `dbus-run-session` in the tests)
and prints every Notify call as a JSON line on stdout. Prints `ready` once the name is owned.
Runs until stdin closes or it is terminated.

    python tests/support/notify_standin.py
"""

from __future__ import annotations

import json
import sys

import gi

gi.require_version("Gio", "2.0")
from gi.repository import Gio, GLib  # noqa: E402

NAME = "org.freedesktop.Notifications"
PATH = "/org/freedesktop/Notifications"
XML = """
<node>
  <interface name="org.freedesktop.Notifications">
    <method name="Notify">
      <arg type="s" direction="in"/><arg type="u" direction="in"/>
      <arg type="s" direction="in"/><arg type="s" direction="in"/>
      <arg type="s" direction="in"/><arg type="as" direction="in"/>
      <arg type="a{sv}" direction="in"/><arg type="i" direction="in"/>
      <arg type="u" direction="out"/>
    </method>
    <method name="GetCapabilities"><arg type="as" direction="out"/></method>
    <method name="GetServerInformation">
      <arg type="s" direction="out"/><arg type="s" direction="out"/>
      <arg type="s" direction="out"/><arg type="s" direction="out"/>
    </method>
    <method name="CloseNotification"><arg type="u" direction="in"/></method>
  </interface>
</node>
"""


def main() -> None:
    loop = GLib.MainLoop()
    counter = [0]

    def on_call(_conn, _sender, _path, _iface, method, params, invocation):
        if method == "Notify":
            app, _replaces, _icon, summary, body, _actions, _hints, _timeout = params.unpack()
            counter[0] += 1
            print(json.dumps({"app": app, "summary": summary, "body": body}), flush=True)
            invocation.return_value(GLib.Variant("(u)", (counter[0],)))
        elif method == "GetCapabilities":
            invocation.return_value(GLib.Variant("(as)", (["body"],)))
        elif method == "GetServerInformation":
            invocation.return_value(GLib.Variant("(ssss)", ("standin", "test", "1", "1.2")))
        else:
            invocation.return_value(None)

    info = Gio.DBusNodeInfo.new_for_xml(XML)

    def on_bus(conn, _name):
        conn.register_object(PATH, info.interfaces[0], on_call, None, None)

    Gio.bus_own_name(
        Gio.BusType.SESSION,
        NAME,
        Gio.BusNameOwnerFlags.NONE,
        on_bus,
        lambda *_: print("ready", flush=True),
        lambda *_: loop.quit(),
    )
    GLib.io_add_watch(
        GLib.IOChannel.unix_new(sys.stdin.fileno()),
        GLib.PRIORITY_DEFAULT,
        GLib.IOCondition.HUP | GLib.IOCondition.IN,
        lambda *_: loop.quit(),
    )
    loop.run()


if __name__ == "__main__":
    main()
