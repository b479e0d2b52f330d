//! Hosts on one machine: Linux network namespaces joined by veth pairs on
//! a bridge, so a multipath can reach the same storage over several real
//! TCP paths, each with its own link to cut, as a SAN gives multipath
//! several controllers to one LUN. Used by `lab mpath`'s remote-paths
//! table and by the multi-host tests (which reuse these guards).
//!
//! The layout is what `ip netns` and `ip link add ... type veth` build by
//! hand: a "switch" namespace holding bridge `br0`, one namespace per
//! host with `eth0` on 10.77.0.(11+i)/24, and a "client" namespace on
//! 10.77.0.2 where the multipath runs. Every address lives inside these
//! namespaces, so nothing touches the machine's own interfaces or
//! routes, and two testbeds never collide: each has its own bridge and
//! its own names (`bks<pid>x<n>-...`). Links are cut on the switch side
//! (`ip link set hN down` in the switch namespace), as pulling a cable
//! from a switch port would.
//!
//! Everything is torn down on drop, even after a panic: the processes
//! still running in a namespace are killed (`ip netns pids`) before it is
//! deleted, which also destroys its veth ends. Namespaces left by a
//! process that was killed outright are swept on the next
//! [`Testbed::new`] (their names carry the dead owner's pid).
//!
//! Nothing here needs more than root and iproute2: [`probe`] says why
//! namespaces cannot be made, so callers can skip with a clear message.

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The testbed's subnet (inside its namespaces only).
pub const SUBNET_PREFIX: &str = "10.77.0";
/// The port every host's NBD server listens on.
pub const NBD_PORT: u16 = 10809;
/// The export name every host serves.
pub const EXPORT: &str = "lun";
/// Prefix of every namespace name made here, for the stale sweep.
const NAME_ROOT: &str = "bks";

/// Run `ip ARGS`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why network namespaces cannot be made here, or `Ok` if they can
/// (a throw-away namespace is created and deleted to find out).
pub fn probe() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if uid != 0 {
        bail!("network namespaces need root (running as uid {uid})");
    }
    if Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        bail!("`ip` (iproute2) is not installed");
    }
    let ns = Netns::create(&format!("{}-probe", unique_prefix()))?;
    ns.ip(&["link", "set", "lo", "up"])?;
    Ok(())
}

/// A name prefix no other live testbed uses: this process's pid and a
/// per-process counter.
pub fn unique_prefix() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{NAME_ROOT}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Delete namespaces made here by processes that no longer run (killed
/// before their guards could drop).
pub fn sweep_stale() {
    let Ok(list) = ip(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix(NAME_ROOT) else {
            continue;
        };
        let Some(pid) = rest.split('x').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(namespace = name, "removing a stale namespace");
            kill_and_delete(name);
        }
    }
}

/// Move the calling thread into namespace `name` (`/run/netns/NAME`).
fn enter(name: &str) -> Result<()> {
    let path = format!("/run/netns/{name}");
    let f = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns on a namespace file we hold open; it only changes the
    // calling thread's network namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        bail!("setns into {name}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn kill_and_delete(name: &str) {
    if let Ok(pids) = ip(&["netns", "pids", name]) {
        let me = std::process::id() as i32;
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .filter(|&p| p != me)
        {
            // SAFETY: kill(2) on a pid the kernel just listed; a pid that
            // has exited meanwhile gets ESRCH, which is fine.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let _ = ip(&["netns", "del", name]);
}

/// One network namespace, deleted (with every process still in it) on drop.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn create(name: &str) -> Result<Netns> {
        ip(&["netns", "add", name]).with_context(|| format!("creating namespace {name}"))?;
        Ok(Netns {
            name: name.to_string(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS`.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// A command that runs `program` inside this namespace
    /// (`ip netns exec NAME program`, which execs it: the child's pid is
    /// the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Move the calling thread into this namespace. Threads it spawns
    /// afterwards start there too, so a stack built on this thread
    /// connects from here.
    pub fn enter_current_thread(&self) -> Result<()> {
        enter(&self.name)
    }

    /// Run `f` on a new thread inside this namespace and wait for it.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let name = self.name.clone();
        self.spawn(f)?
            .join()
            .map_err(|_| anyhow::anyhow!("thread in namespace {name} panicked"))?
    }

    /// Start `f` on a new thread inside this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<std::thread::JoinHandle<Result<T>>> {
        let name = self.name.clone();
        std::thread::Builder::new()
            .name(format!("netns-{name}"))
            .spawn(move || -> Result<T> {
                enter(&name)?;
                f()
            })
            .context("spawning a namespace thread")
    }

    /// Wait until something accepts TCP connections on `addr` as seen
    /// from this namespace.
    pub fn wait_tcp(&self, addr: &str, limit: Duration) -> Result<()> {
        let addr: std::net::SocketAddr = addr
            .parse()
            .with_context(|| format!("'{addr}' is not an address"))?;
        self.run(move || {
            let deadline = Instant::now() + limit;
            loop {
                match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                    Ok(_) => return Ok(()),
                    Err(e) if Instant::now() > deadline => {
                        bail!("nothing listens on {addr} after {limit:?}: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        kill_and_delete(&self.name);
    }
}

/// A host's stack file: `lun`, a `delay` target of `delay_ms` over a
/// `file` target on `file` (with `load_k=1` when `load`: the path then
/// has a capacity of `1/delay` whatever its queue, as `lab mpath`'s
/// in-process paths do).
pub fn delay_over_file(file: &std::path::Path, sectors: u64, delay_ms: f64, load: bool) -> String {
    format!(
        "f: 0 {sectors} file {}\n{EXPORT}: 0 {sectors} delay f 0 {delay_ms}{}\n",
        file.display(),
        if load { " load_k=1" } else { "" }
    )
}

/// A server process, killed (SIGKILL) and reaped on drop.
pub struct Daemon {
    pub what: String,
    child: Option<Child>,
}

impl Daemon {
    pub fn spawn(what: &str, mut cmd: Command) -> Result<Daemon> {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}: {cmd:?}"))?;
        Ok(Daemon {
            what: what.to_string(),
            child: Some(child),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Has it exited (and how)?
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// `kill -9` it now and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The switch, the client and `n` hosts, wired and addressed.
pub struct Testbed {
    pub prefix: String,
    // Drop order: hosts and client before the switch holding their peers.
    pub hosts: Vec<Netns>,
    pub client: Netns,
    pub switch: Netns,
}

impl Testbed {
    /// Build the namespaces, the bridge and one veth pair per member.
    pub fn new(hosts: usize) -> Result<Testbed> {
        if hosts == 0 || hosts > 200 {
            bail!("a testbed has 1..=200 hosts, not {hosts}");
        }
        sweep_stale();
        let prefix = unique_prefix();
        let switch = Netns::create(&format!("{prefix}-sw"))?;
        switch.ip(&["link", "add", "br0", "type", "bridge"])?;
        switch.ip(&["link", "set", "br0", "up"])?;
        let client = Netns::create(&format!("{prefix}-client"))?;
        let mut bed = Testbed {
            prefix: prefix.clone(),
            hosts: Vec::new(),
            client,
            switch,
        };
        bed.attach(None)?;
        for i in 0..hosts {
            bed.hosts.push(Netns::create(&format!("{prefix}-h{i}"))?);
            bed.attach(Some(i))?;
        }
        Ok(bed)
    }

    /// The switch port's name for host `i` (or the client).
    fn port(member: Option<usize>) -> String {
        member.map_or_else(|| "client".to_string(), |i| format!("h{i}"))
    }

    /// One veth pair: `eth0` in the member's namespace, its peer a port
    /// of `br0` in the switch.
    fn attach(&self, member: Option<usize>) -> Result<()> {
        let ns = match member {
            Some(i) => &self.hosts[i],
            None => &self.client,
        };
        let port = Self::port(member);
        let addr = format!("{}/24", Self::addr_of(member));
        self.switch.ip(&[
            "link",
            "add",
            &port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns.name(),
        ])?;
        self.switch.ip(&["link", "set", &port, "master", "br0"])?;
        self.switch.ip(&["link", "set", &port, "up"])?;
        ns.ip(&["addr", "add", &addr, "dev", "eth0"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(())
    }

    fn addr_of(member: Option<usize>) -> String {
        match member {
            Some(i) => format!("{SUBNET_PREFIX}.{}", 11 + i),
            None => format!("{SUBNET_PREFIX}.2"),
        }
    }

    /// Host `i`'s address.
    pub fn host_addr(&self, i: usize) -> String {
        Self::addr_of(Some(i))
    }

    /// The client's address.
    pub fn client_addr(&self) -> String {
        Self::addr_of(None)
    }

    /// Host `i`'s NBD address, `ADDR:PORT`.
    pub fn host_nbd(&self, i: usize) -> String {
        format!("{}:{NBD_PORT}", self.host_addr(i))
    }

    /// The `nbd://` URI of host `i`'s export.
    pub fn host_uri(&self, i: usize) -> String {
        format!("nbd://{}/{EXPORT}", self.host_nbd(i))
    }

    /// Start `program ARGS` in host `i` (its output to `log`) and wait
    /// until it accepts connections on the host's NBD address, as seen
    /// from the client; fails early if it exits first.
    pub fn start_server(
        &self,
        i: usize,
        what: &str,
        program: &std::ffi::OsStr,
        args: &[String],
        log: &std::path::Path,
    ) -> Result<Daemon> {
        let host = self.hosts.get(i).with_context(|| format!("no host {i}"))?;
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = host.command(program);
        cmd.args(args).stdout(out.try_clone()?).stderr(out);
        let mut d = Daemon::spawn(what, cmd)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self
                .client
                .wait_tcp(&self.host_nbd(i), Duration::from_millis(200))
                .is_ok()
            {
                return Ok(d);
            }
            if let Some(st) = d.exited() {
                bail!(
                    "{what} in host h{i} exited ({st}) before listening: {}",
                    std::fs::read_to_string(log).unwrap_or_default().trim()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} in host h{i} did not listen on {} within 30 s",
                    self.host_nbd(i)
                );
            }
        }
    }

    /// `bin serve` (a blkstack binary) in host `i`, exporting [`EXPORT`]
    /// from `stack_text` (e.g. [`delay_over_file`]). Its stack file,
    /// control socket and log go to `dir` as `hI.stack`, `hI.control`,
    /// `hI.log`.
    pub fn start_blkstack(
        &self,
        i: usize,
        bin: &std::path::Path,
        dir: &std::path::Path,
        stack_text: &str,
    ) -> Result<Daemon> {
        let stack = dir.join(format!("h{i}.stack"));
        std::fs::write(&stack, stack_text)
            .with_context(|| format!("writing {}", stack.display()))?;
        let args: Vec<String> = vec![
            "serve".into(),
            "--stack".into(),
            stack.display().to_string(),
            "--export".into(),
            EXPORT.into(),
            "--listen".into(),
            format!("nbd://{}", self.host_nbd(i)),
            "--control".into(),
            dir.join(format!("h{i}.control")).display().to_string(),
        ];
        let log = dir.join(format!("h{i}.log"));
        self.start_server(i, "blkstack serve", bin.as_os_str(), &args, &log)
    }

    /// Cut (`up = false`) or restore host `i`'s link at the switch.
    pub fn set_link(&self, i: usize, up: bool) -> Result<()> {
        if i >= self.hosts.len() {
            bail!("no host {i}");
        }
        let port = Self::port(Some(i));
        self.switch
            .ip(&["link", "set", &port, if up { "up" } else { "down" }])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_unique_and_carry_the_pid() {
        let (a, b) = (unique_prefix(), unique_prefix());
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("{NAME_ROOT}{}x", std::process::id())));
    }

    #[test]
    fn testbed_hosts_reach_each_other_and_links_cut() {
        if let Err(why) = probe() {
            eprintln!("skipped: {why:#}");
            return;
        }
        let bed = Testbed::new(2).unwrap();
        let listener_addr = format!("{}:7000", bed.host_addr(1));
        let l = listener_addr.clone();
        let _listener = bed.hosts[1]
            .run(move || Ok(std::net::TcpListener::bind(&l)?))
            .unwrap();
        bed.client
            .wait_tcp(&listener_addr, Duration::from_secs(5))
            .unwrap();
        // No address of the testbed leaks into the machine's namespace.
        let root = ip(&["-4", "addr"]).unwrap();
        assert!(!root.contains(&format!("{SUBNET_PREFIX}.")), "{root}");
        bed.set_link(1, false).unwrap();
        assert!(bed
            .client
            .wait_tcp(&listener_addr, Duration::from_millis(300))
            .is_err());
        bed.set_link(1, true).unwrap();
        bed.client
            .wait_tcp(&listener_addr, Duration::from_secs(5))
            .unwrap();
        let names: Vec<String> = [&bed.switch, &bed.client, &bed.hosts[0]]
            .iter()
            .map(|n| n.name().to_string())
            .collect();
        drop(bed);
        let list = ip(&["netns", "list"]).unwrap();
        for n in names {
            assert!(!list.contains(&n), "{n} left behind: {list}");
        }
    }
}
