//! The 17 lifecycle hook kinds and their signatures, as the macro checks them.

/// One kind's signature.
pub(crate) struct Kind {
    pub(crate) name: &'static str,
    /// The `ThreadHookHandler` / `UserHookHandler` variant.
    pub(crate) variant: &'static str,
    pub(crate) user_scope: bool,
    /// Parameters, for messages.
    pub(crate) params: &'static [&'static str],
    /// What the hook returns (a path under `lifecycle`), `()` for event hooks.
    pub(crate) returns: &'static str,
}

impl Kind {
    pub(crate) fn is_transform(&self) -> bool {
        self.returns != "()"
    }

    /// `(state: &ThreadState, …) -> T`, for messages.
    pub(crate) fn signature(&self) -> String {
        let returns = if self.is_transform() {
            // `after_system_message` and `after_tool_call_*` also take the value itself.
            let direct = match self.returns {
                "Option<String>" => " or `String`",
                "Option<ToolResult>" => " or `ToolResult`",
                _ => "",
            };
            format!(" and returns `{}`{direct} (or a `Result` of it)", self.returns)
        } else {
            String::new()
        };
        format!("takes `({})`{returns}, sync or async", self.params.join(", "))
    }
}

pub(crate) const KINDS: [Kind; 17] = [
    Kind {
        name: "after_thread_created",
        variant: "AfterThreadCreated",
        user_scope: false,
        params: &["state: &ThreadState"],
        returns: "()",
    },
    Kind {
        name: "after_subagent_created",
        variant: "AfterSubagentCreated",
        user_scope: false,
        params: &["state: &ThreadState", "child: &ThreadState"],
        returns: "()",
    },
    Kind {
        name: "after_system_message",
        variant: "AfterSystemMessage",
        user_scope: false,
        params: &["state: &ThreadState", "system_message: String"],
        returns: "Option<String>",
    },
    Kind {
        name: "filter_messages",
        variant: "FilterMessages",
        user_scope: false,
        params: &["state: &ThreadState", "messages: Vec<Message>"],
        returns: "Vec<Message>",
    },
    Kind {
        name: "prefilter_llm_history",
        variant: "PrefilterLlmHistory",
        user_scope: false,
        params: &["state: &ThreadState", "messages: Vec<LlmMessage>"],
        returns: "Vec<LlmMessage>",
    },
    Kind {
        name: "before_create_message",
        variant: "BeforeCreateMessage",
        user_scope: false,
        params: &["state: &ThreadState", "message: Message"],
        returns: "Message",
    },
    Kind {
        name: "after_create_message",
        variant: "AfterCreateMessage",
        user_scope: false,
        params: &["state: &ThreadState", "message: &Message"],
        returns: "()",
    },
    Kind {
        name: "before_update_message",
        variant: "BeforeUpdateMessage",
        user_scope: false,
        params: &["state: &ThreadState", "message_id: &str", "updates: MessageUpdates"],
        returns: "MessageUpdates",
    },
    Kind {
        name: "after_update_message",
        variant: "AfterUpdateMessage",
        user_scope: false,
        params: &["state: &ThreadState", "message: &Message"],
        returns: "()",
    },
    Kind {
        name: "before_store_tool_result",
        variant: "BeforeStoreToolResult",
        user_scope: false,
        params: &["state: &ThreadState", "call: &ToolCall", "result: ToolResult"],
        returns: "ToolResult",
    },
    Kind {
        name: "after_tool_call_success",
        variant: "AfterToolCallSuccess",
        user_scope: false,
        params: &["state: &ThreadState", "call: &ToolCall", "result: ToolResult"],
        returns: "Option<ToolResult>",
    },
    Kind {
        name: "after_tool_call_failure",
        variant: "AfterToolCallFailure",
        user_scope: false,
        params: &["state: &ThreadState", "call: &ToolCall", "result: ToolResult"],
        returns: "Option<ToolResult>",
    },
    Kind {
        name: "tool_call_started",
        variant: "ToolCallStarted",
        user_scope: false,
        params: &["state: &ThreadState", "call: &ToolCall", "progress: Option<&str>"],
        returns: "()",
    },
    Kind {
        name: "tool_call_done",
        variant: "ToolCallDone",
        user_scope: false,
        params: &["state: &ThreadState", "call: &ToolCall", "result: &ToolResult"],
        returns: "()",
    },
    Kind {
        name: "user_client_attached",
        variant: "UserClientAttached",
        user_scope: true,
        params: &["user: &UserState", "client: &ClientInfo"],
        returns: "()",
    },
    Kind {
        name: "user_client_detached",
        variant: "UserClientDetached",
        user_scope: true,
        params: &["user: &UserState", "client: &ClientInfo"],
        returns: "()",
    },
    Kind {
        name: "user_value_changed",
        variant: "UserValueChanged",
        user_scope: true,
        params: &["user: &UserState", "key: &str"],
        returns: "()",
    },
];

/// What a hook whose kind is missing or unknown expands as (an event hook of thread scope, its
/// body never called): the item exists, so the agents that list it report nothing more.
pub(crate) const STUB: &Kind = &KINDS[0];

pub(crate) fn find(name: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|kind| kind.name == name)
}

pub(crate) fn all_names() -> String {
    KINDS
        .iter()
        .map(|kind| format!("`{}`", kind.name))
        .collect::<Vec<_>>()
        .join(", ")
}
