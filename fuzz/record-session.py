#!/usr/bin/env python3
"""Record real clients' traffic for the fuzz corpus.

A relay: listens on a unix socket, forwards each connection to the real
server's unix socket, and saves what the client sent (the server's input,
which is what the fuzz targets take) as one corpus file per connection.

    record-session.py LISTEN_SOCKET SERVER_SOCKET OUT_DIR PREFIX
"""
import os
import socket
import sys
import threading


def pump(src, dst, log):
    try:
        while True:
            b = src.recv(65536)
            if not b:
                break
            if log is not None:
                log.append(b)
            dst.sendall(b)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def serve(listen, upstream, out_dir, prefix):
    if os.path.exists(listen):
        os.unlink(listen)
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(listen)
    ls.listen(16)
    n = 0
    while True:
        c, _ = ls.accept()
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.connect(upstream)
        n += 1
        log = []
        path = os.path.join(out_dir, "%s-%d" % (prefix, n))

        def run(c=c, u=u, log=log, path=path):
            back = threading.Thread(target=pump, args=(u, c, None))
            back.start()
            pump(c, u, log)
            back.join()
            with open(path, "wb") as f:
                f.write(b"".join(log))
            c.close()
            u.close()

        threading.Thread(target=run, daemon=True).start()


if __name__ == "__main__":
    serve(*sys.argv[1:5])
