/*
 * pcwork: the guest workload of the powercut tests
 * (frontends/cli/tests/kernel_powercut.rs). It runs in the kernel VM on a
 * filesystem over blkstack's `powercut` target and says, in a log kept
 * outside that filesystem (the guest's tmpfs), what a crash must not
 * lose; after the cut and power-on it checks that nothing of it was lost.
 * Written for these tests (no existing tool logs its own fsyncs); built
 * on the host with the system C compiler and copied into the guest.
 *
 *   pcwork files DIR LOG SEED DURABLE
 *       writes DIR/f0, f1, ... of 1 to 17 blocks plus an odd tail each,
 *       content from (SEED, index). Three files in four are fsynced, then
 *       DIR is fsynced, then a line "PATH SEED INDEX" goes to LOG: that
 *       file must survive any cut. The fourth is only pushed to the
 *       device (sync_file_range, no flush). Once DURABLE files are
 *       logged it prints "unflushed" and goes on writing files (DIR/uN,
 *       renamed to DIR/vN, removed 16 files later so the phase can last)
 *       that are pushed down but never flushed, so that a cut always
 *       finds writes in the cache, until an error or a signal ends it
 *       (exit 1, saying where).
 *   pcwork check LOG
 *       reads every file LOG names and compares it with its content;
 *       prints "checked N" and exits 0, or names each bad file, exit 1.
 *   pcwork update DIR NAME SEED [fsync]
 *       writes DIR/NAME.tmp with version SEED and renames it over
 *       DIR/NAME: the classic atomic replace. With `fsync`, the correct
 *       way (fsync the new file before the rename, fsync DIR after);
 *       without, the planted bug: nothing makes the new version durable.
 *   pcwork verify PATH SEED
 *       prints what PATH holds: "new" (version SEED), "missing", "empty"
 *       or "other" (an older version or garbage).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_LEN (17 * 4096 + 4095)

static uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ULL;
	x ^= x >> 33;
	return x;
}

/* The content of file (seed, index): its length and bytes. */
static size_t content(uint64_t seed, uint64_t index, unsigned char *buf)
{
	uint64_t s = mix(seed * 0x9e3779b97f4a7c15ULL + index + 1);
	size_t len = 4096 * (1 + s % 17) + (s >> 8) % 4096;
	size_t i;

	for (i = 0; i < len; i += 8) {
		uint64_t w = mix(s + i);
		size_t n = len - i < 8 ? len - i : 8;
		memcpy(buf + i, &w, n);
	}
	return len;
}

static int write_all(int fd, const unsigned char *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

static int cmd_files(const char *dir, const char *log, uint64_t seed, uint64_t durable_want)
{
	static unsigned char buf[MAX_LEN];
	char path[4096];
	uint64_t i, durable_done = 0;
	int said = 0;
	int dfd = open(dir, O_RDONLY | O_DIRECTORY);
	int lfd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);

	if (dfd < 0 || lfd < 0) {
		fprintf(stderr, "pcwork files: open %s or %s: %s\n", dir, log, strerror(errno));
		return 2;
	}
	for (i = 0;; i++) {
		size_t len = content(seed, i, buf);
		int flushing = durable_done < durable_want;
		int durable = flushing && i % 4 != 3;
		const char *step = "create";
		int fd;

		if (!flushing && !said) {
			printf("unflushed\n");
			fflush(stdout);
			said = 1;
		}
		snprintf(path, sizeof path, flushing ? "%s/f%llu" : "%s/u%llu", dir,
			 (unsigned long long)i);
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
		if (fd < 0)
			goto fail;
		step = "write";
		if (write_all(fd, buf, len) < 0)
			goto fail_fd;
		step = durable ? "fsync" : "sync_file_range";
		if (durable ? fsync(fd) : sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE))
			goto fail_fd;
		step = "close";
		if (close(fd))
			goto fail;
		if (!flushing) {
			char to[4096];

			step = "rename";
			snprintf(to, sizeof to, "%s/v%llu", dir, (unsigned long long)i);
			if (rename(path, to))
				goto fail;
			step = "unlink";
			snprintf(to, sizeof to, "%s/v%llu", dir, (unsigned long long)(i - 16));
			if (i >= 16 && unlink(to) && errno != ENOENT)
				goto fail;
		}
		if (durable) {
			char line[4200];
			int n;

			step = "fsync of the directory";
			if (fsync(dfd))
				goto fail;
			n = snprintf(line, sizeof line, "%s %llu %llu\n", path,
				     (unsigned long long)seed, (unsigned long long)i);
			if (write_all(lfd, (unsigned char *)line, (size_t)n) < 0) {
				fprintf(stderr, "pcwork files: the log %s: %s\n", log, strerror(errno));
				return 2;
			}
			durable_done++;
		}
		continue;
fail_fd:
		close(fd);
fail:
		printf("pcwork files: %s of %s failed after %llu files: %s\n", step, path,
		       (unsigned long long)i, strerror(errno));
		return 1;
	}
}

/* 0 when PATH holds exactly version (seed, index); what it holds otherwise. */
static const char *compare(const char *path, uint64_t seed, uint64_t index)
{
	static unsigned char want[MAX_LEN], got[MAX_LEN + 1];
	size_t len = content(seed, index, want), have = 0;
	int fd = open(path, O_RDONLY);

	if (fd < 0)
		return errno == ENOENT ? "missing" : "unreadable";
	for (;;) {
		ssize_t n = read(fd, got + have, sizeof got - have);
		if (n < 0) {
			close(fd);
			return "unreadable";
		}
		if (n == 0 || (have += (size_t)n) == sizeof got)
			break;
	}
	close(fd);
	if (have == 0)
		return "empty";
	if (have != len || memcmp(got, want, len) != 0)
		return "other";
	return NULL;
}

static int cmd_check(const char *log)
{
	char path[4096];
	unsigned long long seed, index, checked = 0, bad = 0;
	FILE *f = fopen(log, "r");

	if (!f) {
		fprintf(stderr, "pcwork check: %s: %s\n", log, strerror(errno));
		return 2;
	}
	while (fscanf(f, "%4095s %llu %llu", path, &seed, &index) == 3) {
		const char *why = compare(path, seed, index);
		checked++;
		if (why) {
			printf("BAD %s: %s\n", path, why);
			bad++;
		}
	}
	fclose(f);
	printf("checked %llu, bad %llu\n", checked, bad);
	return bad ? 1 : 0;
}

static int cmd_update(const char *dir, const char *name, uint64_t seed, int durable)
{
	static unsigned char buf[MAX_LEN];
	char tmp[4096], dst[4096];
	size_t len = content(seed, 0, buf);
	int fd, dfd;

	snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
	snprintf(dst, sizeof dst, "%s/%s", dir, name);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || write_all(fd, buf, len) < 0 || (durable && fsync(fd)) || close(fd)) {
		perror(tmp);
		return 1;
	}
	if (rename(tmp, dst)) {
		perror(dst);
		return 1;
	}
	if (durable) {
		dfd = open(dir, O_RDONLY | O_DIRECTORY);
		if (dfd < 0 || fsync(dfd)) {
			perror(dir);
			return 1;
		}
		close(dfd);
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 6 && !strcmp(argv[1], "files"))
		return cmd_files(argv[2], argv[3], strtoull(argv[4], NULL, 0),
				 strtoull(argv[5], NULL, 0));
	if (argc == 3 && !strcmp(argv[1], "check"))
		return cmd_check(argv[2]);
	if ((argc == 5 || (argc == 6 && !strcmp(argv[5], "fsync"))) && !strcmp(argv[1], "update"))
		return cmd_update(argv[2], argv[3], strtoull(argv[4], NULL, 0), argc == 6);
	if (argc == 4 && !strcmp(argv[1], "verify")) {
		const char *why = compare(argv[2], strtoull(argv[3], NULL, 0), 0);
		printf("%s\n", why ? why : "new");
		return 0;
	}
	fprintf(stderr, "usage: pcwork files DIR LOG SEED COUNT | check LOG | "
			"update DIR NAME SEED [fsync] | verify PATH SEED\n");
	return 2;
}
