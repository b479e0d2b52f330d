#!/usr/bin/env python3
"""A hostile NBD client for the budget benchmark (docs/BENCHMARKS.md):
negotiate EXPORT with NBD_OPT_GO over the Unix socket SOCK, then send
READ requests for BYTES in total (LEN bytes each) and never read a reply;
hold the connection for HOLD seconds, then close it.

    unread-reads.py SOCK EXPORT BYTES LEN HOLD

Prints how many requests went out (a server that applies backpressure
stops reading them, so the rest stay in the socket buffers or unsent).
"""
import socket, struct, sys, time

def main():
    path, export, total, each, hold = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    f = s.makefile("rb")
    g = f.read(18)
    assert g[:8] == b"NBDMAGIC", g
    s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    data = struct.pack(">I", len(export)) + export + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(data)) + data)  # NBD_OPT_GO
    while True:
        magic, opt, rep, n = struct.unpack(">QIII", f.read(20))
        f.read(n)
        if rep == 1:  # NBD_REP_ACK
            break
        assert rep < 0x80000000, hex(rep)
    count = total // each
    reqs = b"".join(struct.pack(">IHHQQI", 0x25609513, 0, 0, h, (h * each) % (1 << 30), each) for h in range(count))
    s.setblocking(False)
    sent, t_end = 0, time.time() + hold
    while sent < len(reqs) and time.time() < t_end:
        try:
            sent += s.send(reqs[sent:])
        except BlockingIOError:
            time.sleep(0.05)
    print(f"sent {sent // 28} of {count} requests", flush=True)
    time.sleep(max(0.0, t_end - time.time()))
    s.close()

main()
