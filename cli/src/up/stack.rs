//! The processes of one stack as `up` starts them: the loader on the stack's socket and
//! namespace, each worker on its device with its share, the coordinator over the workers with the
//! plan, scheduler, speculation and HTTP flags and the cost model's prediction.

use super::*;

/// What every child of one stack shares.
pub(super) struct StackSpec<'a> {
    pub(super) a: &'a UpArgs,
    pub(super) model: String,
    pub(super) socket: String,
    pub(super) journal: std::path::PathBuf,
    pub(super) ns: String,
    pub(super) shares: crate::fit::Shares,
    /// The cost model's decode pass times, for the coordinator (`--predicted-pass`).
    pub(super) predicted: Option<layerstream_coordinator::cost::Curve>,
    /// How the cost model chose the loader should read: the read-ahead depth
    /// (`--prefetch-depth` overrides it) and whether through the page cache.
    pub(super) reading: Option<crate::plan::Reading>,
}

impl StackSpec<'_> {
    pub(super) fn otlp(&self) -> Vec<String> {
        opt("--otlp-endpoint", &self.a.otlp_endpoint)
    }

    /// Starts the loader daemon on the stack's socket and namespace.
    pub(super) fn start_loader(&self, children: &mut Children) -> Result<Supervised> {
        let pool = SlotFlags {
            slots: Some(self.shares.slots),
            prefetch_depth: self.a.pool.prefetch_depth.or(self.reading.map(|r| r.depth)),
            buffered_reads: self.a.pool.buffered_reads || self.reading.is_some_and(|r| r.buffered),
            ..self.a.pool.clone()
        };
        let mut args: Vec<String> =
            vec!["loader-daemon".into(), "--model".into(), self.model.clone()];
        args.extend([
            "--socket".into(),
            self.socket.clone(),
            "--namespace".into(),
            self.ns.clone(),
        ]);
        args.extend(pool.to_args());
        args.extend(self.otlp());
        spawn(children, "loader-daemon", &args)?;
        Ok(Supervised::new(args))
    }

    /// Starts worker `i` on a free port; returns how to restart it (on the same address, where the
    /// coordinator looks for it) and its address.
    pub(super) fn start_worker(
        &self,
        children: &mut Children,
        i: usize,
    ) -> Result<(Supervised, String)> {
        let mut args: Vec<String> = vec!["worker".into(), "--model".into(), self.model.clone()];
        args.extend([
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--loader-socket".into(),
            self.socket.clone(),
        ]);
        args.extend(worker_device(self.a, &self.shares, i).to_args());
        if self.a.pool.no_verify {
            args.push("--no-verify".into());
        }
        args.extend(self.otlp());
        let addr = spawn(children, &format!("worker {i}"), &args)?.addr;
        let bound = addr.trim_start_matches("http://").to_owned();
        Ok((Supervised::new(with_flag(args, "--listen", &bound)), addr))
    }

    /// Starts the coordinator over `workers`; returns how to restart it (on the same addresses,
    /// where clients look for it) and where it listens.
    pub(super) fn start_coordinator(
        &self,
        children: &mut Children,
        workers: &[String],
    ) -> Result<(Supervised, Listening)> {
        let a = self.a;
        let mut args: Vec<String> =
            vec!["coordinator".into(), "--model".into(), self.model.clone()];
        args.extend(["--listen".into(), a.listen.clone(), "--worker".into(), workers.join(",")]);
        // Jobs survive a restarted coordinator: `up` keeps a journal per stack (removed at exit).
        args.extend(["--journal".into(), self.journal.display().to_string()]);
        let plan = PlanFlags { kv_host_bytes: Some(self.shares.kv_host_bytes), ..a.plan.clone() };
        args.extend(plan.to_args());
        args.extend(a.sched.to_args());
        args.extend(a.spec.to_args());
        args.extend(self.predicted.iter().flat_map(|c| ["--predicted-pass".into(), c.to_string()]));
        // A one-shot `up` (with a prompt) answers and stops: no HTTP server unless asked for.
        let mut http_flags = a.http.clone();
        if a.prompt.is_given() && http_flags.http_listen.is_none() {
            http_flags.http_listen = Some("off".into());
        }
        args.extend(http_flags.to_args());
        if let (Some(c), Some(k)) = (&a.tls_cert, &a.tls_key) {
            args.extend(["--tls-cert".into(), c.display().to_string()]);
            args.extend(["--tls-key".into(), k.display().to_string()]);
        }
        args.extend(self.otlp());
        let l = spawn(children, "coordinator", &args)?;
        let mut args = with_flag(args, "--listen", l.addr.split("://").last().unwrap_or(&l.addr));
        if let Some(h) = &l.http {
            args = with_flag(args, "--http-listen", h.split("://").last().unwrap_or(h));
        }
        Ok((Supervised::new(args), l))
    }
}
