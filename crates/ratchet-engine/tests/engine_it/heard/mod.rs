//! A change stream that hears other processes the way a PostgreSQL store does with
//! LISTEN/NOTIFY, except that the test is the notifier: it sends each `Change` itself. It
//! replaces the `Changes` role of a store whose other roles stay the backend's
//! (`Roles { changes, ..Roles::of(store) }`).

use std::sync::{Arc, Mutex};

use ratchet_store::{Change, ChangeStream, Changes, Roles, Store};
use tokio::sync::mpsc;

pub struct Heard {
    changes: Mutex<Option<mpsc::UnboundedReceiver<Change>>>,
}

impl Heard {
    /// `store`'s roles with this change stream, and the sender through which the test
    /// announces changes to it. The stream can be taken once; it ends when the sender is
    /// dropped.
    pub fn over(store: Arc<dyn Store>) -> (Roles, mpsc::UnboundedSender<Change>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let heard = Heard {
            changes: Mutex::new(Some(receiver)),
        };
        let roles = Roles {
            changes: Arc::new(heard),
            ..Roles::of(store)
        };
        (roles, sender)
    }
}

impl Changes for Heard {
    fn changes(&self) -> Option<ChangeStream> {
        let mut receiver = self.changes.lock().unwrap().take()?;
        Some(Box::pin(futures::stream::poll_fn(move |cx| {
            receiver.poll_recv(cx)
        })))
    }
}
