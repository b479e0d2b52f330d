/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * ublk_dep.h for blkstack's build of the kernel selftest's kublk on a
 * 6.12 ublk_drv: kublk.h includes this ahead of <linux/ublk_cmd.h> so that
 * names the 6.12 uapi header lacks still compile. Written for blkstack
 * (the selftest's own ublk_dep.h plays the same part); the values are the
 * ones later kernels' include/uapi/linux/ublk_cmd.h gives them. The
 * features behind them are absent on 6.12, so kublk is patched to refuse
 * the options that would use them (-z, -e); see README.md.
 */
#ifndef BLKSTACK_KUBLK_UBLK_DEP_H
#define BLKSTACK_KUBLK_UBLK_DEP_H

/* zero-copy buffer registration commands, 6.15 */
#ifndef UBLK_U_IO_REGISTER_IO_BUF
#define UBLK_U_IO_REGISTER_IO_BUF	_IOWR('u', 0x23, struct ublksrv_io_cmd)
#endif
#ifndef UBLK_U_IO_UNREGISTER_IO_BUF
#define UBLK_U_IO_UNREGISTER_IO_BUF	_IOWR('u', 0x24, struct ublksrv_io_cmd)
#endif

/* fail I/O while the server is away instead of queueing it, 6.13 */
#ifndef UBLK_F_USER_RECOVERY_FAIL_IO
#define UBLK_F_USER_RECOVERY_FAIL_IO	(1ULL << 9)
#endif

#endif
