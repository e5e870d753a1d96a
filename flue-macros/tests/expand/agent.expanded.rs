/// Finds duplicate GitHub issues.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Default)]
struct duplicate_finder;
const _: () = {
    use ::flue_runtime::__private::flue_core as __flue;
    #[automatically_derived]
    impl __flue::Agent for duplicate_finder {
        fn definition(&self) -> &__flue::AgentDefinition {
            static DEFINITION: ::std::sync::OnceLock<__flue::AgentDefinition> = ::std::sync::OnceLock::new();
            DEFINITION
                .get_or_init(|| {
                    #[allow(unused_mut)]
                    let mut definition = __flue::AgentDefinition::from_checked(
                        ::std::borrow::Cow::Borrowed("duplicate_finder"),
                    );
                    definition = definition
                        .description("Finds duplicate GitHub issues.");
                    definition = definition.max_steps(6);
                    definition = definition
                        .hooks(
                            ::std::vec![
                                { let hook : __flue::lifecycle::ThreadHook = redact_emails;
                                hook }
                            ],
                        );
                    definition
                })
        }
        fn render_body(&self, props: __flue::AgentProps<'_>) -> __flue::Instruction {
            #[allow(dead_code, unused_variables)]
            fn __flue_agent_body() -> &'static str {
                use_model("openrouter/anthropic/claude-sonnet-4.5");
                use_tool(get_github_issue);
                "You check whether a GitHub issue duplicates an older open issue."
            }
            <&'static str as __flue::agent::IntoInstruction>::into_instruction({
                let _ = props;
                __flue_agent_body()
            })
        }
    }
};
